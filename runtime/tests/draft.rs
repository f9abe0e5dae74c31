//! The prompt-lookup drafter: its search order (longest n-gram first, most
//! recent occurrence first), exactly `k` drafts on a match (continuing into
//! its own drafts), nothing without one, and bad settings refused.

use kiln_runtime::draft::{DraftError, LookupMatch, PromptLookup};

#[test]
fn the_tokens_after_the_matched_suffix_are_proposed() {
    let p = PromptLookup::new(3, 1, 3).unwrap();
    //            0   1   2   3   4   5   6   7   8
    let toks = [10, 11, 12, 13, 14, 15, 99, 11, 12];
    // Suffix [11, 12] occurs at 1 -> continuation 13, 14, 15.
    assert_eq!(p.find(&toks), Some(LookupMatch { ngram: 2, at: 1 }));
    assert_eq!(p.propose(&toks), vec![13, 14, 15]);
}

#[test]
fn the_longest_ngram_wins_over_a_more_recent_shorter_one() {
    let p = PromptLookup::new(2, 1, 3).unwrap();
    //            0  1  2  3  4  5  6  7  8  9 10
    let toks = [1, 2, 3, 40, 41, 9, 3, 50, 1, 2, 3];
    // [3] alone last occurred at 6 (-> 50), but [1, 2, 3] occurs at 0 (-> 40, 41).
    assert_eq!(p.find(&toks), Some(LookupMatch { ngram: 3, at: 0 }));
    assert_eq!(p.propose(&toks), vec![40, 41]);
    // Limited to unigrams, the most recent [3] is taken.
    let uni = PromptLookup::new(2, 1, 1).unwrap();
    assert_eq!(uni.propose(&toks), vec![50, 1]);
}

#[test]
fn among_equal_ngrams_the_most_recent_occurrence_is_used() {
    let p = PromptLookup::new(2, 2, 2).unwrap();
    //            0  1  2  3  4  5  6  7  8  9
    let toks = [5, 6, 70, 71, 5, 6, 80, 81, 5, 6];
    assert_eq!(p.find(&toks), Some(LookupMatch { ngram: 2, at: 4 }));
    assert_eq!(p.propose(&toks), vec![80, 81]);
}

#[test]
fn a_match_near_the_end_continues_into_its_own_drafts() {
    let p = PromptLookup::new(5, 1, 2).unwrap();
    let toks = [7, 1, 2, 1, 2];
    // [1, 2] last occurred at 1; only [1, 2] follows it, then the copy reads
    // the drafts themselves: the period keeps going.
    assert_eq!(p.find(&toks), Some(LookupMatch { ngram: 2, at: 1 }));
    assert_eq!(p.propose(&toks), vec![1, 2, 1, 2, 1]);
    // A run of one token proposes more of it.
    assert_eq!(
        PromptLookup::new(4, 1, 3).unwrap().propose(&[3, 3]),
        vec![3; 4]
    );
}

#[test]
fn no_match_proposes_nothing() {
    let p = PromptLookup::new(3, 1, 3).unwrap();
    assert!(p.propose(&[1, 2, 3, 4, 5]).is_empty());
    assert!(
        p.propose(&[9]).is_empty(),
        "a lone token has no earlier occurrence"
    );
    assert!(p.propose(&[]).is_empty());
    // A min n-gram of 2 ignores a repeated unigram.
    let p2 = PromptLookup::new(3, 2, 3).unwrap();
    assert!(p2.propose(&[1, 2, 3, 2]).is_empty());
    assert_eq!(p.propose(&[1, 2, 3, 2]), vec![3, 2, 3]);
}

#[test]
fn matches_agree_with_a_brute_force_search_on_random_sequences() {
    // An independent restatement of the documented order, checked on many
    // random sequences over a small alphabet (so matches of every size occur).
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = |n: u64| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % n) as u32
    };
    let mut by_size = [0usize; 4];
    for _ in 0..2000 {
        let len = 1 + next(24) as usize;
        let toks: Vec<u32> = (0..len).map(|_| next(5)).collect();
        let (min, max, k) = (1 + next(2) as usize, 3, 1 + next(4) as usize);
        let p = PromptLookup::new(k, min, max).unwrap();
        let mut want = None;
        'sizes: for n in (min..=max).rev() {
            if n >= len {
                continue;
            }
            let mut i = len - n;
            while i > 0 {
                i -= 1;
                if toks[i..i + n] == toks[len - n..] {
                    want = Some((n, i));
                    break 'sizes;
                }
            }
        }
        let got = p.propose(&toks);
        match want {
            None => assert!(got.is_empty(), "{toks:?}: proposed {got:?}"),
            Some((n, i)) => {
                by_size[n] += 1;
                let mut ext = toks.clone();
                for j in 0..k {
                    let t = ext[i + n + j];
                    ext.push(t);
                }
                assert_eq!(got, ext[len..], "{toks:?} min {min} k {k}");
            }
        }
    }
    assert!(
        by_size[1] > 0 && by_size[2] > 0 && by_size[3] > 0,
        "{by_size:?}"
    );
}

#[test]
fn bad_settings_are_refused_with_the_fix() {
    assert_eq!(PromptLookup::new(0, 1, 3), Err(DraftError::NoDrafts));
    assert_eq!(
        PromptLookup::new(2, 0, 3),
        Err(DraftError::BadNgram { min: 0, max: 3 })
    );
    let e = PromptLookup::new(2, 4, 3).unwrap_err();
    assert!(e.to_string().contains("min_ngram <= max_ngram"), "{e}");
}
