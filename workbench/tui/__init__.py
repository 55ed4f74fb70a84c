"""`specpilot-tui`: the Textual workbench over a workspace (see `workbench.tui.app`).

Importing this package imports nothing else: Textual is loaded by `workbench.tui.app` only, so the
headless `--auto` path, which never imports this package, stays free of it.
"""
