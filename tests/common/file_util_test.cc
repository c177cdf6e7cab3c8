#include "common/file_util.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"

namespace hsdp {
namespace {

namespace fs = std::filesystem;

// An empty directory of its own for each test.
std::string FreshDir(const std::string& name) {
  const fs::path dir = fs::path(::testing::TempDir()) /
                       absl::StrCat("file_util_test_", name, "_", ::getpid());
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir.string();
}

std::string Slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)),
                     std::istreambuf_iterator<char>());
}

TEST(ReadFileTest, ReadsEveryByte) {
  const std::string path = FreshDir("read") + "/f";
  std::string bytes(200000, '\0');
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>(i);
  {
    std::ofstream out(path, std::ios::binary);
    out << bytes;
  }
  absl::StatusOr<std::string> read = ReadFile(path);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, bytes);
}

TEST(ReadFileTest, EmptyFileIsEmpty) {
  const std::string path = FreshDir("empty") + "/f";
  std::ofstream(path).close();
  absl::StatusOr<std::string> read = ReadFile(path);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, "");
}

TEST(ReadFileTest, MissingFileIsNotFoundNamingIt) {
  const std::string path = FreshDir("missing") + "/absent";
  absl::StatusOr<std::string> read = ReadFile(path);
  EXPECT_EQ(read.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(read.status().message().find(path), std::string::npos)
      << read.status();
}

TEST(ReadFileTest, UnreadableFileIsPermissionDenied) {
  if (::geteuid() == 0) GTEST_SKIP() << "root reads any file";
  const std::string path = FreshDir("denied") + "/f";
  std::ofstream(path) << "secret";
  ASSERT_EQ(::chmod(path.c_str(), 0), 0);
  absl::StatusOr<std::string> read = ReadFile(path);
  EXPECT_EQ(read.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_NE(read.status().message().find(path), std::string::npos)
      << read.status();
}

TEST(WriteFileAtomicallyTest, CreatesAndReplaces) {
  const std::string path = FreshDir("replace") + "/f";
  ASSERT_TRUE(WriteFileAtomically(path, "one").ok());
  EXPECT_EQ(Slurp(path), "one");
  ASSERT_TRUE(WriteFileAtomically(path, "two", /*sync=*/false).ok());
  EXPECT_EQ(Slurp(path), "two");
  EXPECT_FALSE(fs::exists(path + kTempFileSuffix));
}

TEST(WriteFileAtomicallyTest, KeepsBinaryContents) {
  const std::string path = FreshDir("binary") + "/f";
  const std::string bytes("a\0b\nc", 5);
  ASSERT_TRUE(WriteFileAtomically(path, bytes).ok());
  absl::StatusOr<std::string> read = ReadFile(path);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, bytes);
}

TEST(WriteFileAtomicallyTest, MissingDirectoryFailsNamingThePath) {
  const std::string path = FreshDir("nodir") + "/absent/f";
  absl::Status written = WriteFileAtomically(path, "x");
  EXPECT_EQ(written.code(), absl::StatusCode::kNotFound);
  EXPECT_NE(written.message().find(path), std::string::npos) << written;
}

TEST(WriteFileAtomicallyTest, FailedRenameKeepsTheOldFileAndNoTemp) {
  const std::string dir = FreshDir("rename");
  // A non-empty directory cannot be renamed over.
  const std::string path = dir + "/target";
  fs::create_directories(fs::path(path) / "child");
  EXPECT_FALSE(WriteFileAtomically(path, "x").ok());
  EXPECT_TRUE(fs::is_directory(path));
  EXPECT_FALSE(fs::exists(path + kTempFileSuffix));
}

TEST(AtomicFileWriterTest, NothingAppearsBeforeCommit) {
  const std::string path = FreshDir("writer") + "/f";
  {
    AtomicFileWriter writer(path);
    ASSERT_TRUE(writer.Open().ok());
    ASSERT_TRUE(writer.Append("part one, ").ok());
    ASSERT_TRUE(writer.Append("part two").ok());
    EXPECT_FALSE(fs::exists(path));
    ASSERT_TRUE(writer.Commit().ok());
  }
  EXPECT_EQ(Slurp(path), "part one, part two");
  EXPECT_FALSE(fs::exists(path + kTempFileSuffix));
}

TEST(AtomicFileWriterTest, AbandonedWriterLeavesTheOldFile) {
  const std::string path = FreshDir("abandon") + "/f";
  ASSERT_TRUE(WriteFileAtomically(path, "old").ok());
  {
    AtomicFileWriter writer(path);
    ASSERT_TRUE(writer.Open().ok());
    ASSERT_TRUE(writer.Append("new").ok());
  }
  EXPECT_EQ(Slurp(path), "old");
  EXPECT_FALSE(fs::exists(path + kTempFileSuffix));
}

}  // namespace
}  // namespace hsdp
