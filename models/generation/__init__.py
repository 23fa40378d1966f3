"""The generation loops (autoregressive, block diffusion), their options, prompts with media, and chat."""
