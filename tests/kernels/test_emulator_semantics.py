"""The emulator itself: simdgroup collectives, threadgroup memory and barriers behave as on Metal, and a barrier
that only some threads reach is reported instead of hanging."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from mlxinfer.kernels.build import kernel_dir

pytestmark = pytest.mark.slow  # compiles a C++ program

PROGRAM = r"""
// Metal-style kernels, run through compat_emu.h (included on the command line).
void collectives(device float* out, uint lane, uint tid) {
  const float v = float(tid * tid % 37);
  device float* o = out + tid * 6;
  o[0] = simd_sum(v);
  o[1] = simd_max(v);
  o[2] = simd_broadcast(v, 5);
  o[3] = simd_shuffle_xor(v, 1);
  o[4] = simd_shuffle_down(v, 3);
  o[5] = simd_shuffle(v, (lane + 7) % 32);
}
void reverse(const device float* in, device float* out, uint3 gid, uint tid, uint n) {
  threadgroup float buf[128];
  buf[tid] = in[gid.x];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[gid.x] = buf[n - 1 - tid];
}
void racy_reverse(const device float* in, device float* out, uint3 gid, uint tid, uint n) {
  threadgroup float buf[128];
  buf[tid] = in[gid.x];  // no barrier: a bug the emulator should expose
  out[gid.x] = buf[n - 1 - tid];
}
int main(int argc, char** argv) {
  static float out[64 * 6], in[256], rev[256];
  for (int i = 0; i < 256; ++i) in[i] = float(i);
  const char* err = mlxemu::launch({64, 1, 1}, {64, 1, 1}, [&](const mlxemu::Attrs& t) {
    collectives(out, t.thread_index_in_simdgroup, t.thread_index_in_threadgroup);
  });
  if (err) { std::printf("error %s\n", err); return 1; }
  for (int i = 0; i < 64 * 6; ++i) std::printf("%g ", out[i]);
  std::printf("\n");
  err = mlxemu::launch({256, 1, 1}, {128, 1, 1}, [&](const mlxemu::Attrs& t) {
    reverse(in, rev, t.thread_position_in_grid, t.thread_index_in_threadgroup, t.threads_per_threadgroup.x);
  });
  if (err) { std::printf("error %s\n", err); return 1; }
  for (int i = 0; i < 256; ++i) std::printf("%g ", rev[i]);
  std::printf("\n");
  for (int i = 0; i < 256; ++i) in[i] = float(1000 + i);  // differs from the earlier run's leftovers
  err = mlxemu::launch({256, 1, 1}, {128, 1, 1}, [&](const mlxemu::Attrs& t) {
    racy_reverse(in, rev, t.thread_position_in_grid, t.thread_index_in_threadgroup, t.threads_per_threadgroup.x);
  });
  int wrong = 0;
  for (int g = 0; g < 2; ++g)
    for (int i = 0; i < 128; ++i) wrong += rev[g * 128 + i] != in[g * 128 + 127 - i];
  std::printf("racy wrong %d\n", wrong);
  err = mlxemu::launch({64, 1, 1}, {64, 1, 1}, [&](const mlxemu::Attrs& t) {
    if (t.thread_index_in_threadgroup < 40) threadgroup_barrier(mem_flags::mem_threadgroup);
  });
  std::printf("%s\n", err ? err : "no error");
  err = mlxemu::launch({64, 1, 1}, {64, 1, 1}, [&](const mlxemu::Attrs& t) {
    if (t.thread_index_in_simdgroup != 3) simd_sum(1.0f);
  });
  std::printf("%s\n", err ? err : "no error");
  return 0;
}
"""


@pytest.fixture(scope="module")
def output(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("emu-semantics")
    src, exe = tmp / "semantics.cpp", tmp / "semantics"
    src.write_text(PROGRAM)
    cxx = shutil.which("g++")
    assert cxx, "the kernel emulator needs g++"
    subprocess.run([cxx, "-std=c++20", "-O1", "-w", "-I", str(kernel_dir()), "-include", "compat_emu.h",
                    str(src), "-o", str(exe)], check=True, capture_output=True)
    return subprocess.run([str(exe)], check=True, capture_output=True, text=True, timeout=60).stdout.splitlines()


def test_simd_collectives(output):
    vals = [float(v) for v in output[0].split()]
    x = [float(t * t % 37) for t in range(64)]
    for t in range(64):
        lane, base = t % 32, t // 32 * 32
        group = x[base:base + 32]
        want = [sum(group), max(group), group[5], group[lane ^ 1],
                group[lane + 3] if lane + 3 < 32 else group[lane], group[(lane + 7) % 32]]
        assert vals[t * 6:t * 6 + 6] == want, f"thread {t}"


def test_threadgroup_memory_and_barrier(output):
    rev = [float(v) for v in output[1].split()]
    assert rev == [float(g * 128 + 127 - i) for g in range(2) for i in range(128)]


def test_a_missing_barrier_gives_wrong_results(output):
    wrong = int(output[2].split()[-1])
    assert wrong > 64, "reading threadgroup memory without a barrier should see stale values"


def test_divergent_barriers_are_reported(output):
    assert "barrier divergence" in output[3] and "24 of 64 threads finished" in output[3]
    assert "barrier divergence" in output[4]
