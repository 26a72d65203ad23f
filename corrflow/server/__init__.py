"""The ServerApp (`flwr run`), simulation entry points and the `corrflow` CLI.

`app.run_server` wires identity resolution, the factorization, σ calibration and the strategy
together.
"""
