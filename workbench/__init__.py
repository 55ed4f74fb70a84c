"""The workbench: CLI, workspaces, harness, token forcing, agents and the TUI."""
