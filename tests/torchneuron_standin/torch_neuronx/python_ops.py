"""TorchNeuron's Python-registered ATen kernels (`torch_neuronx.python_ops`).

In the stand-in every op runs on the reference device's C++ kernels, so there is nothing to register.
"""
