"""Agents that explore a direction on their own branch: the built-in tuner and the LLM agent."""
