"""Speculative decoding: proposers (n-gram prompt lookup, self-speculative draft), the rejection sampler
that keeps the target's output distribution, and the engine-side decoder that drives them per step."""
