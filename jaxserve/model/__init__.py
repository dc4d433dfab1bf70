"""The model alone: configs, the Flax transformer (Llama family and Gemma 3), its paged-attention
interface (attention is injected, never imported from a kernel), and the checkpoint loaders."""
