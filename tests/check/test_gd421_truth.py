"""GD421 checked against the installed torch (2.13, CPU): a recurrent state carried from one training step into the
next without ``.detach()`` makes the second ``loss.backward()`` fail, for nn.RNN, nn.LSTM (tuple state) and
nn.GRUCell alike; detaching the state between steps, or re-initialising it, trains."""

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

_MESSAGE = (
    "Trying to backward through the graph a second time (or directly access saved tensors after they have "
    "already been freed). Saved intermediate values of the graph are freed when you call .backward() or "
    "autograd.grad(). Specify retain_graph=True if you need to backward through the graph a second time or if you "
    "need to access saved tensors after calling backward."
)


def _train(step, steps=2):
    torch.manual_seed(0)
    state = None
    for _ in range(steps):
        loss, state = step(state)
        loss.backward()
    return state


def _rnn(detach):
    rnn = nn.RNN(3, 4, batch_first=True)

    def step(h):
        out, h = rnn(torch.randn(2, 5, 3), h)
        return out.pow(2).mean(), (h.detach() if detach else h)

    return step


def _lstm(detach):
    lstm = nn.LSTM(3, 4)

    def step(state):
        out, state = lstm(torch.randn(5, 2, 3), state)
        return out.sum(), (tuple(v.detach() for v in state) if detach else state)

    return step


def _gru_cell(detach):
    cell = nn.GRUCell(3, 4)

    def step(h):
        h = cell(torch.randn(2, 3), h)
        return h.sum(), (h.detach() if detach else h)

    return step


@pytest.mark.parametrize("build", [_rnn, _lstm, _gru_cell])
def test_carried_state_fails_at_the_second_backward(build):
    with pytest.raises(RuntimeError) as error:
        _train(build(detach=False))
    assert str(error.value) == _MESSAGE


@pytest.mark.parametrize("build", [_rnn, _lstm, _gru_cell])
def test_detached_state_trains(build):
    _train(build(detach=True), steps=3)


def test_first_step_alone_succeeds():
    """The failure needs a second step: one backward on a fresh state is fine."""
    _train(_rnn(detach=False), steps=1)


def test_retain_graph_then_optimizer_step_fails_on_modified_weights():
    """The error message's own suggestion, retain_graph=True, with an optimizer step between the two backwards:
    the second backward needs the first step's weights, which the step changed in place."""
    torch.manual_seed(0)
    rnn = nn.RNN(3, 4)
    optimizer = torch.optim.SGD(rnn.parameters(), lr=0.1)
    h = None
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        for _ in range(2):
            out, h = rnn(torch.randn(5, 2, 3), h)
            optimizer.zero_grad()
            out.sum().backward(retain_graph=True)
            optimizer.step()


def test_frozen_recurrent_module_carries_no_graph():
    """Why GD421 skips frozen modules: with its parameters frozen and inputs without grad, the carried state has no
    graph, so a head trained on its features backwards every step without error."""
    torch.manual_seed(0)
    encoder = nn.GRU(3, 4, batch_first=True).requires_grad_(False)
    probe = nn.Linear(4, 1)
    state = None
    for _ in range(3):
        features, state = encoder(torch.randn(2, 5, 3), state)
        assert state.grad_fn is None
        probe(features[:, -1]).sum().backward()
