"""Terminal UI: the only package that imports Rich and prompt-toolkit."""
