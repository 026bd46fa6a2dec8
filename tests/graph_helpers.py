"""A CPU stand-in for CUDA-graph capture, shared by the body-graph tests."""

import torch


class StandInCapture:
    """CUDA-graph semantics without a GPU: capture runs nothing that lasts (``state`` is put back, as a capture
    would not have advanced it), and each replay reruns the body on the same inputs into the same outputs."""

    def __init__(self, state: list[torch.Tensor]):
        self.state = state

    def __call__(self, body, inputs):
        before = [t.clone() for t in self.state]
        outputs = body(*inputs)
        for t, b in zip(self.state, before):
            t.copy_(b)

        def replay():
            for o, n in zip(outputs, body(*inputs)):
                if o is not None:
                    o.copy_(n)

        return replay, outputs
