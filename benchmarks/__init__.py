"""nostall speed benchmarks: run from the repository root as `python -m benchmarks.<script>`."""
