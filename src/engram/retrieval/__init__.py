"""Retrieval: token ids -> table row ids, outside the model (paper section 2.2).

config (EngramConfig and its profiles), primes (prime table sizes), compress (tokenizer
compression V -> V'), hashing (suffix n-grams, multiplicative-XOR hashing, decode streams, and the
Hasher protocol every caller uses), hot and mphf (Engram-Nine's collision-free hot tier),
reference (a literal NumPy port of the official hashing: test oracle and benchmark baseline).
Depends on nothing else in engram but options.
"""
