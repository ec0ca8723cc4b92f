"""Clean-workload fuzzing (the common framework lives here; engine modules: ``vllm``)."""
