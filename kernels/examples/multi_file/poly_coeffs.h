// The coefficients of poly.cc: y = a*x^2 + b*x + c (+ kPolyBias).
#pragma once

constexpr float kPolyA = 1.0f;
constexpr float kPolyB = 2.0f;
constexpr float kPolyC = 3.0f;
constexpr float kPolyBias = 0.0f;
