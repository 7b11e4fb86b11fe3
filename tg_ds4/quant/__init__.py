"""Numbers in packed form: block formats and their matmuls (formats), how a matmul rounds its input (activations),
integer block dot products on the CPU (intdot), the float type matmuls run in (precision), and the K-quant writer."""
