"""Rendezvous ports: outside the kernel's ephemeral range (where Ray's outgoing connections take
their local ports and can take ours between the check and the store's listen), free on every address."""

import random
import socket

from rlhf_core.infra import network


def test_the_rendezvous_range_lies_between_rays_worker_ports_and_the_ephemeral_ones():
    span = network.rendezvous_ports((32768, 60999))
    assert span.start == 20000 and span.stop == 32768
    assert len(network.rendezvous_ports((15000, 60999))) == 0  # no room: the kernel picks


def test_a_rendezvous_port_is_outside_the_ephemeral_range_and_free_on_every_address():
    low, _ = network.ephemeral_ports()
    port = network.rendezvous_port(random.Random(0))
    if len(network.rendezvous_ports((low, 0))):
        assert network.RAY_WORKER_PORTS[1] < port < low
    with socket.socket() as s:
        s.bind(("", port))  # would raise if anything held it on any address


def test_a_port_held_on_another_address_than_loopback_is_not_taken(monkeypatch):
    with socket.socket() as held:
        held.bind(("", 0))
        held.listen()
        taken = held.getsockname()[1]
        with socket.socket() as spare:  # a port free a moment ago (the one after `taken` may be anyone's)
            spare.bind(("", 0))
            free = spare.getsockname()[1]
        # the draw first offers the held port, then the free one: the held one is skipped
        draws = iter([taken, free])
        monkeypatch.setattr(network, "rendezvous_ports", lambda _e: range(min(taken, free), max(taken, free) + 1))
        rng = random.Random()
        monkeypatch.setattr(rng, "choice", lambda _span: next(draws))
        assert network.rendezvous_port(rng) == free
