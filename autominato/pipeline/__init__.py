"""The staged asynchronous pipeline: stages, queues, buffer pool, sampler, loader."""
