"""TorchNeuron's custom-kernel support (`torch_neuronx.kernels`): needs Trainium, not simulated."""
