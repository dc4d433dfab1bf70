"""What touches jax on the engine's side: the runner and its compiled step programs, the step's
inputs and buckets, on-device sampling, the KV pool, the compile cache, the dtype plan and the
machine's measured traits. The runner takes arrays, not requests: it computes and never decides.
"""
