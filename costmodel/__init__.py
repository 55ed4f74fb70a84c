"""Roofline cost model: hardware and model profiles, step times, ceilings, ranked gaps (see DESIGN.md)."""
