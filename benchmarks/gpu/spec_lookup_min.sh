#!/bin/bash
# Issue 20 on the H100, bundled model: spec_configs.sh once per n-gram prompt_lookup_min in MINS (default "1 4";
# num_speculative_tokens 4, prompt_lookup_max 4), with the ShareGPT-like part unless SHAREGPT=0.
CONFIGS=$(for mn in ${MINS:-1 4}; do printf "4:%s:4 " "$mn"; done) SHAREGPT=${SHAREGPT:-128} \
  exec bash benchmarks/gpu/spec_configs.sh
