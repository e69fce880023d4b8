"""The model: the decoder (Llama, Mistral, Mixtral), its attention, its shape and presets, its FLOPs,
and Hugging Face config and weights in and out. No process group, no config sections: a leaf of train/."""
