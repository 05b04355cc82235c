"""
A lookup draft source for dflash2.spec_generate(..., lookup=...): drafts taken from the request's own tokens (the
prompt and the output so far), which repeat themselves in code, edits and quoted text, and the gate that decides
each cycle between them and the DFlash2 drafter. It owns the search, the proposal's score and the gate. It does not
own verification: dflash2.speculative_decode_step verifies a lookup's draft with a point-mass q, so the output is
the target's, token for token at T = 0 and in law at T > 0, whatever this module proposes.

The proposal (suffix decoding's, over one request): with x the L tokens so far, find the longest suffix
x[L−m:] with min_match <= m <= max_match that also ends earlier, at e < L (an occurrence). Its continuation reads
y = x + the draft so far from e on: it may run into the draft, as an LZ77 copy does, so a periodic tail is continued
for all of max_tokens. The draft is built greedily: at step t, among the occurrences whose continuation agrees with
the draft so far, take the most frequent next token (ties: the latest occurrence's), c_t of the n_t, and keep the
occurrences that took it. The score is the draft's expected acceptance length, bonus included, if the target's next
token agreed with probability f_t = (c_t + 1) / (n_t + 2) (Laplace's rule of succession: one occurrence is weak
evidence, and raw shares would score every single match a full draft): 1 + Σ_t Π_{u<=t} f_u.

With fallback, where no suffix occurred earlier, the proposal is one token: the one that most often followed the last
token earlier (ties: the latest occurrence's), c of the n, score 1 + (c + 1) / (n + 2); or, where the last token never
occurred before, the last token itself, score 1 (the bonus alone).
"""


def most_frequent(tokens):
    """The most frequent of tokens (ties: the latest) -> (token, its count)."""
    counts = {}
    for token in tokens:
        counts[token] = counts.get(token, 0) + 1
    token = max(reversed(tokens), key=counts.get)
    return token, counts[token]


def by_source(stats):
    """{source: (cycles, tokens committed)} of a GenerationStats, from its per-cycle sources and acceptance lengths."""
    counts = {}
    for source, length in zip(stats.sources, stats.acceptance_lengths):
        cycles, tokens = counts.get(source, (0, 0))
        counts[source] = (cycles + 1, tokens + length)
    return counts


class SuffixLookup:
    """One request's lookup draft source. lookup(tokens, stats) -> the draft, or [] where the gate says the drafter
    drafts. gate: a number, the expected acceptance length a draft must pass, or "drafter": the mean acceptance
    length of the drafter's cycles so far (1 before its first). fallback: a one-token guess where no suffix matched
    (module docstring); with gate 0 the lookup then drafts every cycle it is asked (all but a last one with one token
    left, n = 0) and spec_generate asks the drafter for no draft: the lookup alone as a decoder, through the same
    verification code as the hybrid (bench.real's "our lookup alone").
    log: (score, threshold, taken) of every call, score 0 where nothing was proposed. The index (n-gram of min_match
    tokens -> the positions it ends at) reads each token once; a list that does not extend the tokens already read
    starts it over."""

    def __init__(self, max_tokens=16, min_match=2, max_match=16, gate="drafter", fallback=False):
        if not (isinstance(max_tokens, int) and max_tokens >= 1):
            raise ValueError(f"max_tokens ({max_tokens!r}) must be an integer >= 1")
        if not (isinstance(min_match, int) and isinstance(max_match, int) and 1 <= min_match <= max_match):
            raise ValueError(f"min_match ({min_match!r}) and max_match ({max_match!r}) must be integers with "
                             "1 <= min_match <= max_match")
        if not (gate == "drafter" or type(gate) in (int, float) and gate >= 0):
            raise ValueError(f"gate ({gate!r}) must be a number >= 0 or 'drafter'")
        self.max_tokens, self.min_match, self.max_match, self.gate = max_tokens, min_match, max_match, gate
        self.fallback = fallback
        self.tokens, self.ends, self.log = [], {}, []

    def read(self, tokens):
        """Index the n-grams of tokens that end before its last position (the suffix itself is not an occurrence)."""
        if tokens[:len(self.tokens)] != self.tokens:
            self.tokens, self.ends = [], {}
        m = self.min_match
        for e in range(max(m, len(self.tokens)), len(tokens)):  # an n-gram ending at e has a next token, x[e]
            self.ends.setdefault(tuple(tokens[e - m:e]), []).append(e)
        self.tokens = list(tokens)

    def propose(self, tokens):
        """-> (draft of max_tokens, score) from the longest suffix that occurred earlier (module docstring); if none
        did, fallback's guess, or ([], 0.0)."""
        x, L = list(tokens), len(tokens)
        self.read(x)
        candidates = self.ends.get(tuple(x[L - self.min_match:]), []) if L > self.min_match else []
        if not candidates:
            return self.guess(x) if self.fallback else ([], 0.0)

        def match(e):  # the length of the suffix that also ends at e, up to max_match
            m = self.min_match
            while m < min(self.max_match, e) and x[e - m - 1] == x[L - m - 1]:
                m += 1
            return m
        lengths = [match(e) for e in candidates]
        longest = max(lengths)
        occurrences = [e for e, m in zip(candidates, lengths) if m == longest]  # in order: the latest last
        y, reach, score = list(x), 1.0, 1.0  # y: the tokens, then the draft so far
        while len(y) - L < self.max_tokens:
            token, count = most_frequent([y[p] for p in occurrences])
            reach *= (count + 1) / (len(occurrences) + 2)
            score += reach
            occurrences = [p + 1 for p in occurrences if y[p] == token]
            y.append(token)
        return y[L:], score

    @staticmethod
    def guess(x):
        """fallback's proposal (module docstring): -> ([token], score)."""
        follows = [x[i + 1] for i in range(len(x) - 1) if x[i] == x[-1]]  # a scan: the index holds min_match-grams
        if not follows:
            return x[-1:], 1.0
        token, count = most_frequent(follows)
        return [token], 1.0 + (count + 1) / (len(follows) + 2)

    def __call__(self, tokens, stats):
        draft, score = self.propose(tokens)
        if self.gate == "drafter":
            cycles, committed = by_source(stats).get("drafter", (0, 0))
            threshold = committed / cycles if cycles else 1.0
        else:
            threshold = self.gate
        taken = bool(draft) and score > threshold
        self.log.append((score, threshold, taken))
        return draft if taken else []
