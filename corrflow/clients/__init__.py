"""Flower ClientApps: a numpy regression client (tests, quick runs) and a Keras next-word-prediction client; each
returns its model delta and example count. ``tasks.get_task`` pairs a client with server-side evaluation.
"""
