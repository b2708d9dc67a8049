"""The Typer command-line shell over the mlxinfer API: parse, call, render."""
