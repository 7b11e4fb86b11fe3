"""GPU renderers (workgroups, no CPU threads): kernel_opts for the quantized GEMVs."""
