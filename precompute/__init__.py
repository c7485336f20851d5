"""Stage one: read a manifest, decode each file once, encode codes/latents/text ids, write shards.

Modules: ``manifests`` (rows), ``audio`` / ``images`` (decoding), ``prepare`` (per-row decode in
workers), ``encoders`` (codec, VAE, tokenizer registry and fingerprint), ``job`` (chunking,
overlap, resume, multi-rank), ``config``, ``cli``.
"""
