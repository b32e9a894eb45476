"""What a developer or evaluator runs: local, the in-process harness, chaos, wan-proxy, bench, sim."""
