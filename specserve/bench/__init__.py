"""``specserve bench``: plain decoding, proposers and optional peers side by side, with a report and plots."""
