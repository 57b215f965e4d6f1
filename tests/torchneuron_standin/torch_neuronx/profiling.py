"""TorchNeuron's device profiler (`torch_neuronx.profiling`): needs the Neuron runtime, not simulated."""


class NeuronProfiler:
    """TorchNeuron's profiler; the stand-in has no device trace to give."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError("the TorchNeuron stand-in does not simulate NeuronProfiler")
