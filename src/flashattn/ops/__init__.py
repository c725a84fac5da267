"""The op layer: every op of the library registered with torch.library through one helper (registry.Op), with
its fake implementation and autograd; each op's body calls the backend that serves its tensors
(flashattn.backends). The public functions validate their arguments and call one op."""
