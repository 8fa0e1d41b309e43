// sanitizers.hpp: which sanitizer this test was built with, so stress loops scale down and timing
// bounds widen under the asan and tsan presets (their instrumentation slows every thread).
#pragma once

#if defined(__SANITIZE_THREAD__)
#define EBB_TEST_TSAN_ 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define EBB_TEST_TSAN_ 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__)
#define EBB_TEST_ASAN_ 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define EBB_TEST_ASAN_ 1
#endif
#endif

#ifdef EBB_TEST_TSAN_
inline constexpr bool kTsan = true;
#else
inline constexpr bool kTsan = false;
#endif
#if defined(EBB_TEST_TSAN_) || defined(EBB_TEST_ASAN_)
inline constexpr bool kSanitized = true;
#else
inline constexpr bool kSanitized = false;
#endif
// Divide stress loops' rounds by this: 5 under a sanitizer, else 1.
inline constexpr int kSanitizerScale = kSanitized ? 5 : 1;
