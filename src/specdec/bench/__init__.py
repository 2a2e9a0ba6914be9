"""``specdec bench``: speculative decoding against target-only and ``transformers`` on the same prompts.

``prompts`` (the prompt file, τ lists; no torch), ``contenders`` (what is timed and what one run returns),
``stats`` (pure analysis: ideal speedup, identity, per-contender figures, goals, costs), ``run`` (measuring,
interleaved, and the report), ``report`` (table, Markdown, plot). Import from the submodules: this face
imports nothing, so reading prompts does not load the engine.
"""
