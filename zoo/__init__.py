"""Loom's built-in models: small Llama checkpoints that Loom's own code trains from scratch on traces
its own code writes and verifies, so that tests and the embedded default never download weights
(docs/models.md). ``zoo.registry`` names them (``LOOM_MODEL``); ``zoo.tiny`` and ``zoo.search`` hold
their tasks, traces, tokenizer, weights and recipes.

The walls (docs/architecture.md): ``zoo`` imports the shared core ``loom`` and nothing else of Loom;
the core never imports ``zoo``; services and the launcher may.
"""
