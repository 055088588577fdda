"""A stand-in for moeflow.graphs' CUDA-graph capture on the CPU (tests/test_eager_graphs.py,
tests/test_eager_buckets.py)."""


class FakeCapture:
    """Stands for graphs._Captured on the CPU: counts captures and replays, and replays by calling fn on copies of the
    inputs made at capture time (so a test sees that the inputs are copied in, as the real one does). ``made`` lists
    every capture (tests reset it)."""

    made = []

    def __init__(self, fn, inputs, pool=None, own_inputs=True):
        self.fn, self.replays = fn, 0
        self.inputs = tuple(x.clone() for x in inputs) if own_inputs else tuple(inputs)
        FakeCapture.made.append(self)

    def replay(self):
        self.replays += 1
        return self.fn(*self.inputs)

    def __call__(self, inputs):
        for static, x in zip(self.inputs, inputs):
            static.copy_(x)
        return self.replay().clone()
