"""The noise node: a separate party that holds a run's noise key and joins every secure round as
one more SecAgg+ participant, its input the round's noise on the quantization grid — so that the
server unmasks only noised sums (`node`: the protocol; `store`: its directory and journal, the
authority on what was released; `process`: the child process of a simulation; `protocol`: the
names the server, the clients' guard mod and the noise node share). Knows nothing of the server's
run; the server's side is `corrflow.run.noise_node_link`."""
