"""kvcanary.engines — adapters that translate an engine's structures into `BatchDescription`s."""
