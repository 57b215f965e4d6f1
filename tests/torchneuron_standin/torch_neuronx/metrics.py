"""TorchNeuron's runtime metrics report (`torch_neuronx.metrics`): not simulated.

The torch.compile metrics are `torch_neuronx.get_dynamo_metrics()` (see neuron_dynamo_backend/metrics.py).
"""
