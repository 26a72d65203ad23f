"""Federated datasets generated on the fly (seeded, no downloads): per-user regression data and StackOverflow-style
synthetic text. Real-format loaders and on-disk generators follow (issue 6).
"""
