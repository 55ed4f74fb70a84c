"""The lab around the runtime: bench, training, corpus, quality checks and hardware measurement.

It stays in the installed package; a workspace carries only the runtime (decoder/ without lab/), the code
an agent edits."""
