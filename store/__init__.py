"""The SQLite memory of deployments, runs, branches, forcing reports and mechanisms (see DESIGN.md)."""
