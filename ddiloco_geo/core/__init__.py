"""Vocabulary and pure code: errors, settings, bucket layout, clocks, signing, fragments, merge, outer optimizer, model, data."""
