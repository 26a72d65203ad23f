"""Flower ClientApps: a numpy regression client (tests, quick runs) and a Keras next-word-prediction
client; each returns its new weights and example count (cross-silo: the sum of per-example clipped
updates), and answers the identity probe through
`corrflow_identity_mod`. ``tasks.get_task`` pairs a client with
server-side evaluation.
"""
