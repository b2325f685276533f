"""torch.compile taken apart: Dynamo's graphs and breaks, AOTAutograd's forward and backward,
Inductor's generated code, and vLLM's piecewise compilation of the book's model."""
