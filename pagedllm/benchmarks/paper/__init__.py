"""The paper's evaluation (Kwon et al., SOSP 2023, §6–§7): one module per figure, `pagedllm bench paper <fig>`."""
