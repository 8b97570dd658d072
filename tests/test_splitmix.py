"""splitmix64 (``areal_async/splitmix.py``) against its published outputs."""

from areal_async.splitmix import GOLDEN, MASK64, mix64, splitmix64


def test_splitmix64_gives_the_published_stream():
    # The stream seeded 1234567 (Rosetta Code, "Pseudo-random numbers/Splitmix64"): the state steps
    # by GOLDEN and output k is mix64(seed + k * GOLDEN), k = 1, 2, ...; splitmix64(x) is the
    # first output of the stream seeded x, so output k is splitmix64(seed + (k - 1) * GOLDEN).
    expected = [6457827717110365317, 3203168211198807973, 9817491932198370423, 4593380528125082431,
                16408922859458223821]
    assert [splitmix64(1234567 + k * GOLDEN) for k in range(5)] == expected
    assert splitmix64(0) == 0xE220A8397B1DCDAF  # the first output of the stream seeded 0
    assert mix64(1234567 + GOLDEN) == expected[0] and mix64(-1) == mix64(MASK64)  # taken modulo 2**64
