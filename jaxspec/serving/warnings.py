"""The low-acceptance warning: where a draft may cost more than it saves."""

from __future__ import annotations

DEFAULT_WARN_BELOW = 0.6  # acceptance rate under which a draft model's speculation is flagged


def below(rate: float, threshold: float) -> str:
    """"0.5996 is below 0.60": the rate with as many digits (2 to 6) as show it under the threshold."""
    digits = next((d for d in range(2, 7) if round(rate, d) < threshold), 6)
    return f"{rate:.{digits}f} is below {threshold:.2f}"


def low_acceptance_message(rate: float, threshold: float, draft_name: str, target_name: str, note: str = "") -> str:
    return (
        f"acceptance rate {below(rate, threshold)}: the draft {draft_name!r} may cost more "
        f"than it saves for target {target_name!r} (try a smaller num_draft_tokens, a better-matched "
        f"draft, the canary (--auto), or plain decoding){note}"
    )
