"""ttj-jax's benchmarks: the harness replica, the torch peer, timing, and the `ttj-bench` CLI."""
