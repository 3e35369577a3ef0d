"""The vLLM engine: ``engine.py`` on the trainer's side, ``server.py`` in vLLM's own environment
(``env.py`` finds it). Only ``server.py`` imports vLLM, and only vLLM's interpreter runs it."""
