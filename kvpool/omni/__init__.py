"""Multi-stage (omni) pipelines: each stage an engine running one model, its outputs the next stage's inputs."""
