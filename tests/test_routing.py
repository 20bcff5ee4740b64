"""SATER routing on synthetic answers: voting, costs, curves and their areas, stage I/II builders."""

import numpy as np
import pytest

from jaxalign.data.sater import REFUSAL, is_refusal
from jaxalign.sampling.routing import (
    Answers,
    CostModel,
    RoutePoint,
    area,
    build_stage1,
    build_stage2,
    cascade_point,
    pre_generation_point,
    summarize,
    weighted_vote,
)


def test_refusal_matching_is_robust():
    assert is_refusal(REFUSAL) and is_refusal("sorry, i cant answer that") and is_refusal("Sorry, I can")
    assert is_refusal("Sorry I cannot answer that.")
    assert not is_refusal("The answer is 5.") and not is_refusal("")


def test_weighted_vote():
    assert weighted_vote(["5", "It is 6", "6", REFUSAL], [0.9, 0.2, 0.3, 5.0]) == ("5", pytest.approx(0.9 / 6.4))
    assert weighted_vote([REFUSAL, REFUSAL], [1.0, 1.0]) == (None, 0.0)
    assert weighted_vote(["6", "5"], [0.5, 0.5])[0] == "5"  # ties break by answer order


def test_pre_generation_costs_and_accuracy():
    golds = ["1", "2", "3", "4"]
    small = ["1", REFUSAL, "0", REFUSAL]
    point = pre_generation_point(0.5, small, [1, 4, 1, 4], [True, True, True, False], [2, 2, 2, 2], golds,
                                 CostModel(small_price=1.0, large_price=10.0))
    assert point.accuracy == 0.5  # q1 small right, q2 routed right, q3 small wrong, q4 routed wrong
    assert point.routed == 0.5
    assert point.cost == pytest.approx((1 + 4 + 1 + 4 + 2 * 10 * 2) / 4)


def test_cascade_escalates_below_the_share_threshold():
    answers = Answers(texts=[["5", "5", "6"], ["7", "8", "9"]], n_tokens=[[1, 1, 1], [1, 1, 1]],
                      confidence=[[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    keep_all = cascade_point(0.0, answers, [True, True], [3, 3], ["5", "9"], CostModel())
    strict = cascade_point(0.5, answers, [True, True], [3, 3], ["5", "9"], CostModel())
    assert keep_all.accuracy == 0.5 and keep_all.routed == 0.0  # q2's vote "7" (first of a tie) is wrong
    assert strict.accuracy == 1.0 and strict.routed == 0.5  # q2 (share 1/3) escalates


def test_areas_random_golden_and_curve():
    low, high = RoutePoint(0, 0.4, 1.0, 0.0), RoutePoint(1, 0.9, 11.0, 1.0)
    assert area([], low, high) == pytest.approx(0.65)  # straight line = random routing
    small_correct = [True] * 4 + [False] * 6
    good = [RoutePoint(0.5, 0.8, 4.0, 0.3)]
    summary = summarize(good, low, high, small_correct)
    assert summary["toa"] > summary["toa_random"] == pytest.approx(0.65)
    assert summary["toa_golden"] >= summary["toa"] and 0 < summary["togr"] <= 1


def test_stage_builders():
    answers = Answers(texts=[["It is 5 because 2 + 3 = 5.", "5", "I think it is 6."], ["4", "4"], ["1", "2"]],
                      n_tokens=[[9, 1, 5], [1, 1], [1, 1]], confidence=[[1.0] * 3, [1.0] * 2, [1.0] * 2])
    records, stats = build_stage1(["2+3?", "2+2?", "0+1?"], ["5", "4", "1"], answers)
    # 2+2 has no incorrect sample; 0+1's correct and incorrect answers have the same length
    assert stats == {"pairs": 1, "skipped_questions": 2}
    assert records[0]["chosen"][0]["content"] == "5" and records[0]["rejected"][0]["content"] == "I think it is 6."
    assert (records[0]["chosen_len"], records[0]["rejected_len"]) == (1, 5)
    stage2 = build_stage2(["2+3?", "2+2?"], ["5", "4"], Answers(answers.texts[:2], answers.n_tokens[:2],
                                                                answers.confidence[:2]), [0.1, 0.5, 0.7, 1.0])
    refusal_rate = [np.mean([r["target"] == REFUSAL for r in stage2 if r["tau"] == tau])
                    for tau in (0.1, 0.5, 0.7, 1.0)]
    assert refusal_rate == sorted(refusal_rate) and refusal_rate[0] == 0.0 and refusal_rate[-1] == 0.5
    assert {r["target"] for r in stage2 if r["question"] == "2+3?" and r["tau"] <= 0.5} == {"5"}
