"""Real ``mlxinfer serve`` processes on 127.0.0.1 for the serve tests (the bundled SmolLM2, greedy where it matters).

``server``: default limits, shared by the whole directory. ``limited``: --parallel 1 --queue-size 1, an API key and
a small body limit, for the limit tests. Both are started once per session; tests that stop a server start their
own.
"""

from __future__ import annotations

import pytest
from serve_helpers import API_KEY, start_server


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("serve"))
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def limited(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("serve-limited"), "--parallel", "1", "--queue-size", "1",
                       "--max-body", "4096",
                       "--allow-origin", "http://ui.example", key=API_KEY)
    yield srv
    srv.stop()
