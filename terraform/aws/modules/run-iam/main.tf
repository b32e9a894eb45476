# Least-privilege roles derived from the bucket layout. layout.json is generated from
# ddiloco_geo.keys.role_prefixes() and checked by tests/deploy/test_iam_layout.py: a layout change
# the policies miss fails CI.
#
# Learner identity: one role per learner fleet. Learners in fleet F use ids "F-<instance id>" and
# may write only learners/F-*/ (the wildcard stays inside the fleet: ids contain no '/').

data "aws_partition" "current" {}

locals {
  layout     = jsondecode(file("${path.module}/layout.json"))
  bucket_arn = "arn:${data.aws_partition.current.partition}:s3:::${var.bucket_name}"

  # role -> {read, write} prefixes relative to the run, wildcard filled in per fleet.
  role_prefixes = merge(
    {
      for fleet in var.learner_fleets : "learner-${fleet}" => {
        for access, prefixes in local.layout.roles.learner :
        access => [for p in prefixes : replace(p, local.layout.learner_placeholder, "${fleet}-*")]
      }
    },
    { syncer = local.layout.roles.syncer },
  )

  # A prefix ending in "/" is a directory (prefix*); anything else is one key.
  object_arns = {
    for role, access in local.role_prefixes : role => {
      for kind, prefixes in access : kind => [
        for p in prefixes : endswith(p, "/") ? "${local.bucket_arn}/${var.run_prefix}/${p}*" : "${local.bucket_arn}/${var.run_prefix}/${p}"
      ]
    }
  }
  list_patterns = {
    for role, access in local.role_prefixes : role => [for p in access.read : "${var.run_prefix}/${p}*"]
  }
}

data "aws_iam_policy_document" "role" {
  for_each = local.role_prefixes

  statement {
    sid       = "ReadLayoutPrefixes"
    actions   = ["s3:GetObject"]
    resources = local.object_arns[each.key].read
  }

  statement {
    sid       = "ListLayoutPrefixes"
    actions   = ["s3:ListBucket"]
    resources = [local.bucket_arn]

    condition {
      test     = "StringLike"
      variable = "s3:prefix"
      values   = local.list_patterns[each.key]
    }
  }

  statement {
    sid       = "WriteOwnPrefixes"
    actions   = ["s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"]
    resources = local.object_arns[each.key].write
  }

  dynamic "statement" {
    for_each = var.kms_key_arn == null ? [] : [var.kms_key_arn]

    content {
      sid       = "UseBucketKey"
      actions   = ["kms:Decrypt", "kms:GenerateDataKey"]
      resources = [statement.value]
    }
  }
}

data "aws_iam_policy_document" "trust" {
  for_each = local.role_prefixes

  statement {
    sid     = "Ec2Instances"
    actions = ["sts:AssumeRole"]

    principals {
      type        = "Service"
      identifiers = ["ec2.amazonaws.com"]
    }
  }

  dynamic "statement" {
    for_each = length(lookup(var.gcp_learner_subjects, trimprefix(each.key, "learner-"), [])) > 0 && each.key != "syncer" ? [1] : []

    content {
      sid     = "GoogleServiceAccounts"
      actions = ["sts:AssumeRoleWithWebIdentity"]

      principals {
        type        = "Federated"
        identifiers = ["accounts.google.com"]
      }

      condition {
        test     = "StringEquals"
        variable = "accounts.google.com:sub"
        values   = var.gcp_learner_subjects[trimprefix(each.key, "learner-")]
      }
    }
  }
}

resource "aws_iam_role" "role" {
  for_each = local.role_prefixes

  name                 = "${var.name_prefix}-${each.key}"
  description          = "ddiloco-geo ${each.key} for s3://${var.bucket_name}/${var.run_prefix}"
  assume_role_policy   = data.aws_iam_policy_document.trust[each.key].json
  max_session_duration = 3600
  tags                 = var.tags
}

resource "aws_iam_role_policy" "bucket" {
  for_each = local.role_prefixes

  name   = "run-bucket"
  role   = aws_iam_role.role[each.key].id
  policy = data.aws_iam_policy_document.role[each.key].json
}

resource "aws_iam_instance_profile" "role" {
  for_each = local.role_prefixes

  name = "${var.name_prefix}-${each.key}"
  role = aws_iam_role.role[each.key].name
  tags = var.tags
}
